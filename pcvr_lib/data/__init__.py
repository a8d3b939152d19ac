"""Data side: generation, Arrow -> batch conversion, caches, augmentations, splits and the loader."""
