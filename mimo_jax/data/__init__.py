"""Data files shipped with the package (see each subdirectory's LICENSE) and the prompt samplers."""
