"""Architecture tests: which parts of kernelcrew may import which (read from the source, never run)."""
