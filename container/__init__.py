"""The `hearth` command line, gunicorn configuration and the SageMaker `serve` entry."""
