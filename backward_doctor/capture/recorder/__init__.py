"""The recorders: every aten op (Python dispatch mode or the native observer), live memory, tensor statistics, index checks, CUDA figures, collectives and torch.compile's compiling."""
