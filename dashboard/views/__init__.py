"""The dashboard's pages: layout and widgets only."""
