"""Program rewrites, one pass per module (installed as ``autopar.passes``)."""
