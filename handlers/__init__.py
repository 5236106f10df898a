"""The HTTP face of hearth: wire schema, serving classes, and the Falcon app.

`protocol` holds the pydantic wire models, `serving` the transport-neutral OpenAI /
SageMaker / TGI semantics (reused by HTTP and Lambda), `http` the Falcon ASGI app.
"""
