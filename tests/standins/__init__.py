"""Local stand-ins of the cloud function APIs the cloud backends invoke, for tests and local checks.

:mod:`~tests.standins.lambda_api` serves AWS Lambda's Invoke API and
:mod:`~tests.standins.fc_api` Function Compute 3.0's function and invoke APIs
on 127.0.0.1, so boto3 and the FC SDK work unchanged through an endpoint override; both run
each invocation in a fresh subprocess through :mod:`~tests.standins.runner`.
"""
