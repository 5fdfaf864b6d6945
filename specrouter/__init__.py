"""specrouter: a load-aware router in front of EAGLE-3 and baseline SGLang server pairs."""

__version__ = "0.1.0"
