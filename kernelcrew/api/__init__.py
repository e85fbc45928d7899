"""The REST API of the kernelcrew service (FastAPI)."""
