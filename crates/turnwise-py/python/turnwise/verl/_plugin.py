"""verl plugin entry point (``verl.plugins``): importing it registers turnwise's advantage
estimators and policy losses in verl's registries (:func:`turnwise.verl.register`)."""

from . import register

register()
