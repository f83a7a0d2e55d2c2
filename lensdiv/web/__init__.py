"""`lensdiv explore`: a local web app over one loaded model (session, server, page)."""
