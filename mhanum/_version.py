"""The package version, in one place (imported by the package and the modules that write records)."""

__version__ = "0.1.0"
