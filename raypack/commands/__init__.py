"""One module per `raypack` command, each with `run(args) -> exit code`; raypack/cli.py parses
the arguments and imports only the module of the command it runs. Nothing else imports these."""
