#!/bin/sh
# PID 1 of the hearth image (exec-form ENTRYPOINT). It only picks the command and then
# `exec`s it, so the server itself becomes PID 1 and receives SIGTERM from Docker,
# SageMaker (SIGKILL follows 30 s later) and Lambda directly.
#
#   docker run IMAGE                      -> serve   (the SageMaker contract, port 8080)
#   docker run IMAGE serve                -> serve   (what SageMaker runs)
#   docker run IMAGE --max-model-len 4096 -> hearth serve --max-model-len 4096
#   docker run IMAGE hearth serve /models/x --host 0.0.0.0  -> as given
set -e
if [ "$#" -eq 0 ]; then
    set -- serve
fi
case "$1" in
    -*) set -- hearth serve "$@" ;;
esac
exec "$@"
