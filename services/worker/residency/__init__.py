"""Load-adaptive residency (DESIGN §4): optional history pages, resident-first admission,
whole-request reclaim (eq. 4) and bounded repopulation, within eq. 3."""
