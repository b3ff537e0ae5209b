"""Layer placeholder: filled by a later issue (see DESIGN.md layers)."""
