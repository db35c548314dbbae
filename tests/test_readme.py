"""The README's recipe reference is the schema's own (regenerate with `reference_markdown()`)."""
from pathlib import Path

from sparsebalance_ft.recipe import reference_markdown


def test_readme_recipe_reference_matches_the_schema():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert reference_markdown() in readme, "README recipe reference is stale: paste sparsebalance_ft.recipe.reference_markdown()"
