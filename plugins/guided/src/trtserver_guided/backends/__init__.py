"""One module per guided-decoding library; each imports its library lazily."""
