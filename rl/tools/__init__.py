"""Tools the environments expose: files and shell, search, solids."""
