"""The API's routers, one module per noun: health, jobs, kb (knowledge base), workers."""
