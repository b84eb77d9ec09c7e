"""BAPO: batch adaptation policy optimization."""
__version__ = "0.1.0"
