"""The portable PyTorch engine. ``from trtserver.engine.torch.engine import TorchEngine``."""
