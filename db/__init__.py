"""ddpdash's metrics store: engine factory, models, migrations, writer and queries."""
