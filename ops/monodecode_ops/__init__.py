"""monodecode-ops: build, precompile, verify and inspect mono-decode images and nodes."""
