"""GPU operators (Triton), each beside the plain PyTorch reference it is tested against."""
