"""eaglescope: train, serve and debug EAGLE-3 draft models."""

__version__ = "0.1.0"
