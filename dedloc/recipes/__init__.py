"""Recipes: what a collaboration trains, as config dataclasses every peer of a run shares."""

from dedloc.recipes.mlm import RECIPES, MLMRecipe, get_recipe

__all__ = ["RECIPES", "MLMRecipe", "get_recipe"]
