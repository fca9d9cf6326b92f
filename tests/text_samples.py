"""Texts that the data and tokenizer tests share: code, Unicode beyond the BMP, runs of
whitespace and line endings that a byte-level tokenizer must round-trip exactly."""

SAMPLES = {
    "code.py": "def f(x, y=2):\n    \"\"\"Doc.\"\"\"\n    return {'a': [x ** y, x // y]}\n\n\n"
               "class A:\n\tpass  # tab-indented\n",
    "unicode.txt": "Héllo wörld — naïve café. 😀🎉👩\u200d💻 日本語のテキスト、中文字符。한국어 "
                   "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u00a0non-breaking\u200bzero-width\r\nCRLF line\n",
    "spaces.txt": "   leading spaces\n\n\n\n   trailing   \n\t\t mixed \t whitespace  \n" + " " * 37,
}
