import typer
from typer.testing import CliRunner

from sbft_cli.init_tiny import register


def _app():
    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None:  # keeps `init-tiny` a subcommand even when it is the only one
        pass

    return app


def test_init_tiny_command(tmp_path):
    out = tmp_path / "tiny"
    result = CliRunner().invoke(_app(), ["init-tiny", str(out), "--hidden-size", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1"])
    assert result.exit_code == 0, result.output
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


def test_init_tiny_command_bad_family_exits_2(tmp_path):
    result = CliRunner().invoke(_app(), ["init-tiny", str(tmp_path / "x"), "--family", "gpt2"])
    assert result.exit_code == 2
    assert "family 'gpt2'" in result.output
