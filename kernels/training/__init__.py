"""TwELL training: the autograd FFN op, its CSR format, and its sparse forward and backward kernels."""
