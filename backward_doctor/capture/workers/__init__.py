"""DataLoader workers started during a run: the main process's side, what runs inside a worker, the files they leave."""
