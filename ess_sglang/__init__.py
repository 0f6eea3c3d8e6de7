"""ESS for SGLang: lossless offload of the DeepSeek Sparse Attention latent cache to pinned host memory."""

__version__ = "0.1.0"
