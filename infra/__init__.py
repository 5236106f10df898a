"""Deployment tooling for hearth: boto3 code that talks to AWS and nothing else.

This package deliberately imports nothing of the server (``container``, ``handlers``,
``engine``, ``kernels``): it runs on a laptop or in CI, where torch and a GPU are absent, and
drives SageMaker, Application Auto Scaling, S3 and Lambda with the same container image the
server ships in.  The ``hearth deploy`` and ``hearth invoke`` commands come from
:func:`infra.cli.add_commands`.
"""
