"""What the recording uses to watch storages: the weak-reference storage tracker (``storages``), the
model and optimizer state read at the end of a trace (``state``), and the leak finder (``leaks/``)."""
