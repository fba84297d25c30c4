"""magis: fit PyTorch training in less memory (MAGIS, ASPLOS'24)."""
