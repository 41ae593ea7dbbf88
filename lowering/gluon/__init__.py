"""Gluon (Triton's explicit-layout dialect) prototypes of hot kernels; not wired into the ops."""
