"""`python -m fastdecode.cli`: how the fleet supervisor starts each service."""

from fastdecode.cli import main

main()
