"""The Python side of the native kernels: building them for this CPU and calling them.

The sources are the repository's top-level ``kernels/`` directory, reached here as ``src`` (a link
in a checkout, copied files in a wheel); ``qmatmul`` builds and loads the library (the GGUF
block products, and the paged decode attention that ``attention`` calls).
"""
