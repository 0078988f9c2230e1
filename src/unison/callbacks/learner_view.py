"""`LearnerView` under its historical name: `unison.learner_view` defines it one layer down.

>>> from unison.callbacks.learner_view import LearnerView
"""

from unison.learner_view import LearnerView

__all__ = ["LearnerView"]
