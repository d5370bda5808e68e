"""Experiments that each answered one question about torchpipe's design once (see README.md here); not run by CI."""
