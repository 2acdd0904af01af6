"""Normalize rules, each with before/after text; switchable; idempotent on random unicode."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corpus.normalize import fix_whitespace, normalize_text, strip_chapter_headings, strip_gutenberg
from corpus.sample import pile_text, _rng
from corpus.config import NormalizeConfig

ALL = NormalizeConfig()


@pytest.mark.parametrize("before, after", [
    ("a\r\nb\rc", "a\nb\nc"),
    ("tabs\tand   runs \u00a0of\u2009spaces", "tabs and runs of spaces"),
    ("trailing   \nspaces\t\n", "trailing\nspaces"),
    ("one\n\n\n\n\ntwo", "one\n\ntwo"),
    ("\n\n  padded document \n\n", "padded document"),
    ("keeps\n\nparagraphs\nand lines", "keeps\n\nparagraphs\nand lines"),
])
def test_whitespace(before, after):
    assert fix_whitespace(before) == after


def test_ftfy_fixes_mojibake_and_entities():
    out = normalize_text("The caf\u00c3\u00a9 don\u00e2\u20ac\u2122t close &amp; the &quot;bar&quot; opens.", ALL)
    assert out.text == "The caf\u00e9 don't close & the \"bar\" opens."
    assert out.changed_by == ["ftfy"]


def test_gutenberg_licence_header_and_footer_removed():
    book = pile_text(_rng(0, "g"), "Gutenberg (PG-19)", 0)
    out = normalize_text(book, ALL)
    assert "Project Gutenberg" not in out.text and "START OF" not in out.text and "END OF" not in out.text
    assert out.changed_by == ["whitespace", "gutenberg", "chapter_headings"]  # the cut exposes "CHAPTER I"
    assert out.text == out.text.strip() and not out.text.startswith("CHAPTER")
    kept_heading = normalize_text(book, NormalizeConfig(chapter_headings=False))
    assert kept_heading.text.startswith("CHAPTER I\n\n") and kept_heading.text.endswith(out.text)
    # Without both markers nothing is cut: a book that merely mentions Project Gutenberg stays.
    mention = "We thank Project Gutenberg.\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nno end marker"
    assert strip_gutenberg(mention) == mention


@pytest.mark.parametrize("before, after", [
    ("Chapter One\n\nIt was a dark night.", "It was a dark night."),
    ("CHAPTER IV.\n\nChapter 2\nText here.", "Text here."),
    ("chapter twelve\nText.", "Text."),
    ("It begins. Chapter One is later.\nChapter One", "It begins. Chapter One is later.\nChapter One"),
    ("Chapter One of my life was hard.", "Chapter One of my life was hard."),
])
def test_chapter_headings_at_the_start_only(before, after):
    assert strip_chapter_headings(before) == after


def test_each_rule_switches_off():
    text = "Chapter One\n\nCaf\u00c3\u00a9   &amp;   x\r\n"
    assert normalize_text(text, ALL).text == "Caf\u00e9 & x"
    off = {f.name: False for f in dataclasses.fields(NormalizeConfig) if f.type in (bool, "bool")}
    assert normalize_text(text, NormalizeConfig(**off)).text == text
    only_ws = normalize_text(text, NormalizeConfig(ftfy=False, chapter_headings=False))
    assert only_ws.text == "Chapter One\n\nCaf\u00c3\u00a9 &amp; x" and only_ws.changed_by == ["whitespace"]


def test_minimum_length_and_empty_documents_are_dropped_with_a_reason():
    assert normalize_text(" \t\r\n ", ALL).dropped == "empty after normalization"
    assert normalize_text("Chapter One\n\n", ALL).dropped == "empty after normalization"
    assert normalize_text("short", NormalizeConfig(min_chars=10)).dropped == "shorter than 10 characters"
    assert normalize_text("long enough text", NormalizeConfig(min_chars=10)).dropped is None


def test_clean_text_is_untouched_byte_for_byte():
    text = 'Path C:\\new\\table, a "quoted" \\u0041, \U0001f600 \u4e2d\u6587.\n\nSecond paragraph.'
    out = normalize_text(text, ALL)
    assert out.text == text and out.changed_by == []


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=120)
       | st.text(alphabet="\u00c3 \u00e2\u20ac\u2122\u00a0\u2028\r\n\t&amp;;Chapter One*", max_size=80))
def test_idempotent(text):
    once = normalize_text(text, ALL)
    twice = normalize_text(once.text, ALL)
    assert twice.text == once.text and twice.changed_by == []
