"""The live recording: session (trace() context manager), recorder buffers, and decoding into Arrow.

Everything that runs while a trace records lives here; everything downstream
(analyses, render, io) consumes the finished, immutable ``Trace``.
"""
