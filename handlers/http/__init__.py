"""The Falcon ASGI app: routes, middleware, media, errors and metrics over the serving
classes. `asgi.py` is what gunicorn's uvicorn workers load."""
