"""The `sbft` command line: thin Typer commands over the `sparsebalance_ft` library (installed as `sbft_cli`)."""
