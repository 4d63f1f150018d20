"""Actors: the kernel (:mod:`rollart.actors.kernel`) below one package per role
(``scheduler``, ``env``, ``generate``, ``trainer``, ``reward``) and what two roles share
(:mod:`rollart.actors.groups`). A role imports the kernel and ``groups``, never another role.
"""
