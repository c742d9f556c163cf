"""A training loop as the capture sees it: iterations, which ones are recorded op by op, optimizer steps, the loss series, library loops."""
