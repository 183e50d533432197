"""A small regression project written for plain PyTorch Lightning (it knows nothing of lightning_zero)."""
