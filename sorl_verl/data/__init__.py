"""Datasets: verl parquet records and the converters of public QA and medical multiple-choice sets (the embedded worlds live in sorl_verl.embedded)."""
