"""The course: exercises whose checks compare a student's function with lensdiv's own.

``tutorials/course/`` holds the notebooks, one lesson each; this package holds what they import:
the toy model and its prompts (:mod:`~lensdiv.course.toy`), the checker
(:mod:`~lensdiv.course.checker`) and one module of checked exercises per lesson. A check prints
one line on success, "not done yet" on a blank exercise, the student's own traceback when their
code raises, and otherwise a diagnosis of the likely mistake with expected against got.

It sits at the top of the layers, beside :mod:`lensdiv.testing`: its references are lensdiv's
analyzers and operations.
"""
