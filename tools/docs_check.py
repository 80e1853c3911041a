"""Opens the built site in headless Chromium, offline, and checks what it shows.

`make docs-check` runs it after `make docs`. Each page of docs/_build/html is
loaded from disk (file://) with the network off (Chromium runs in a network
namespace of its own, `unshare --net`, where it can; its host resolver maps
every name to nothing besides). It fails, naming page and element, on:

* math left raw: ``\\(`` or ``\\[`` in the page's rendered text (code blocks
  aside), or a formula that MathJax did not typeset;
* a table wider than the space it is shown in, where the reader cannot
  scroll to what is cut off (the page itself scrolling sideways counts as
  cut off), or a cell whose text is clipped;
* an image that does not load, or any resource (script, stylesheet, font)
  that fails, or a request that leaves the machine;
* a private path (``optax_accum._``, ``optax._src``) in a rendered signature
  of the API reference: its text, or a link's hover title.

Chromium is driven over the DevTools protocol on a pipe (stdlib only); it is
Debian's package, `chromium` (`make docs-check` installs it where missing).

Usage: python tools/docs_check.py [--site docs/_build/html] [--width 1400]
  [--screenshots DIR] [PAGE ...]
"""

import argparse
import base64
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The pages whose picture the closing note of a docs change shows.
SCREENSHOTS = {
  "landing": ("docs/index.html", None),
  "api": ("docs/api/optax_accum.html", None),
  "api-formula": ("docs/api/optax_accum.html", "div.math"),
  "migration": ("docs/guides/multisteps.html", None),
  "migration-table": ("docs/guides/multisteps.html", "table"),
}
# Pages that are not the site's own reading: the source listings, indexes.
SKIP = ("_modules/", "_static/", "_sources/", "genindex.html", "search.html")
PRIVATE = ("optax_accum._", "optax._src")

# Runs in the page once it has loaded and MathJax has typeset it: returns
# the problems found, as strings.
PAGE_PROBLEMS = r"""
(async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;
  }
  await document.fonts.ready;
  const problems = [];
  const where = (el) => {
    const id = el.id || (el.closest('[id]') || {}).id || '';
    return el.tagName.toLowerCase() + (id ? ' near #' + id : '');
  };
  const main = document.querySelector('article') || document.body;

  // Math: nothing raw in the rendered text, every formula typeset.
  const clone = main.cloneNode(true);
  clone.querySelectorAll('pre, code, .highlight, script, style, mjx-assistive-mml')
    .forEach((el) => el.remove());
  const text = clone.textContent;
  for (const delimiter of ['\\(', '\\[']) {
    const at = text.indexOf(delimiter);
    if (at >= 0) {
      problems.push('raw math ' + delimiter + ': "' +
        text.slice(Math.max(0, at - 30), at + 50).replace(/\s+/g, ' ') + '"');
    }
  }
  main.querySelectorAll('span.math, div.math').forEach((el) => {
    if (!el.querySelector('mjx-container')) {
      problems.push('formula not typeset (' + where(el) + '): ' +
        el.textContent.replace(/\s+/g, ' ').slice(0, 60));
    }
  });

  // Tables: each one as wide as the column it is shown in at most. A wider
  // one sits in a box that scrolls sideways (furo's table wrapper), where a
  // reader does not see, nor look for, the columns off to the right.
  main.querySelectorAll('table').forEach((table) => {
    const box = table.parentElement.closest('.table-wrapper') || main;
    const over = table.getBoundingClientRect().width - box.clientWidth;
    if (over > 1) {
      problems.push('table wider than its column by ' + Math.round(over) +
        'px, its right part out of sight (' + where(table) + '): ' +
        table.textContent.trim().slice(0, 40).replace(/\s+/g, ' '));
    }
    table.querySelectorAll('th, td').forEach((cell) => {
      const style = getComputedStyle(cell);
      if (cell.scrollWidth > cell.clientWidth + 1 &&
          (style.overflowX === 'hidden' || style.overflowX === 'clip')) {
        problems.push('cell text clipped (' + where(cell) + '): ' +
          cell.textContent.replace(/\s+/g, ' ').slice(0, 40));
      }
    });
  });
  const page = document.scrollingElement;
  if (page.scrollWidth > page.clientWidth + 1) {
    problems.push('the page scrolls sideways: ' + page.scrollWidth +
      'px wide in a ' + page.clientWidth + 'px window');
  }

  // Images that did not load.
  document.querySelectorAll('img').forEach((img) => {
    if (!img.complete || img.naturalWidth === 0) {
      problems.push('broken image: ' + img.getAttribute('src'));
    }
  });

  // Private paths in signatures: their text and their links' titles.
  const privatePaths = PRIVATE;
  document.querySelectorAll('dt.sig').forEach((sig) => {
    const shown = [sig.textContent, ...Array.from(
      sig.querySelectorAll('[title]'), (el) => el.getAttribute('title'))];
    for (const path of privatePaths) {
      if (shown.some((s) => s.includes(path))) {
        problems.push('private path ' + path + ' in the signature of ' +
          (sig.id || sig.textContent.slice(0, 60)));
      }
    }
  });
  return problems;
})()
""".replace("PRIVATE", json.dumps(list(PRIVATE)))


def chromium_binary() -> str:
  for candidate in (
    "/usr/lib/chromium/chromium",
    "chromium",
    "chromium-browser",
  ):
    found = shutil.which(candidate)
    if found:
      return found
  sys.exit(
    "docs_check: no Chromium found; `apt-get install chromium` (Debian's"
    " package; `make docs-check` installs it)."
  )


def offline_prefix() -> list[str]:
  """`unshare --net`, where it works (root): Chromium gets no network."""
  unshare = shutil.which("unshare")
  if unshare is None:
    return []
  trial = subprocess.run([unshare, "--net", "true"], capture_output=True)
  return [unshare, "--net"] if trial.returncode == 0 else []


class Browser:
  """Headless Chromium on the DevTools protocol over a pipe (fds 3 and 4)."""

  def __init__(self, width: int, height: int):
    to_chrome_r, self._to_chrome = os.pipe()
    self._from_chrome, from_chrome_w = os.pipe()
    self._profile = pathlib.Path(tempfile.mkdtemp(prefix="docs_check-"))
    command = [
      *offline_prefix(),
      chromium_binary(),
      "--headless",
      "--no-sandbox",  # root, in a container
      "--disable-gpu",
      "--remote-debugging-pipe",
      "--host-resolver-rules=MAP * ~NOTFOUND",
      "--no-first-run",
      "--hide-scrollbars",
      f"--user-data-dir={self._profile}",
      f"--window-size={width},{height}",
      "about:blank",
    ]

    def wire_pipes():
      os.dup2(to_chrome_r, 3)
      os.dup2(from_chrome_w, 4)

    self._process = subprocess.Popen(
      command,
      pass_fds=(3, 4),
      preexec_fn=wire_pipes,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
    )
    os.close(to_chrome_r)
    os.close(from_chrome_w)
    self.offline = command[0].endswith("unshare")
    self._buffer = b""
    self._next_id = 0
    self.events: list[dict] = []
    target = self.call("Target.createTarget", url="about:blank")["targetId"]
    self._session = self.call(
      "Target.attachToTarget", targetId=target, flatten=True
    )["sessionId"]
    for domain in ("Page", "Network", "Runtime"):
      self.call(f"{domain}.enable", session=True)
    self.call(
      "Emulation.setDeviceMetricsOverride",
      session=True,
      width=width,
      height=height,
      deviceScaleFactor=1,
      mobile=False,
    )

  def _read(self) -> dict:
    while b"\0" not in self._buffer:
      chunk = os.read(self._from_chrome, 1 << 20)
      if not chunk:
        raise RuntimeError("Chromium closed the DevTools pipe")
      self._buffer += chunk
    message, self._buffer = self._buffer.split(b"\0", 1)
    return json.loads(message)

  def call(self, method: str, session: bool = False, **params):
    self._next_id += 1
    message = {"id": self._next_id, "method": method, "params": params}
    if session:
      message["sessionId"] = self._session
    os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
    while True:
      reply = self._read()
      if reply.get("id") == self._next_id:
        if "error" in reply:
          raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})
      self.events.append(reply)

  def wait_for(self, event: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if any(e.get("method") == event for e in self.events):
        return
      self.events.append(self._read())
    raise TimeoutError(event)

  def open(self, url: str) -> list[dict]:
    """Loads *url*; returns the network events of the load."""
    self.events = []
    self.call("Page.navigate", session=True, url=url)
    self.wait_for("Page.loadEventFired")
    return self.events

  def evaluate(self, expression: str):
    result = self.call(
      "Runtime.evaluate",
      session=True,
      expression=expression,
      awaitPromise=True,
      returnByValue=True,
      timeout=30000,
    )
    if "exceptionDetails" in result:
      raise RuntimeError(json.dumps(result["exceptionDetails"])[:500])
    return result["result"].get("value")

  def screenshot(self, path: pathlib.Path, selector: str | None) -> None:
    if selector:
      self.evaluate(
        f"document.querySelector({json.dumps(selector)})"
        ".scrollIntoView({block: 'start', behavior: 'instant'});"
        " window.scrollBy({top: -160, behavior: 'instant'})"
      )
    else:
      self.evaluate("window.scrollTo({top: 0, behavior: 'instant'})")
    data = self.call("Page.captureScreenshot", session=True, format="png")
    path.write_bytes(base64.b64decode(data["data"]))

  def close(self) -> None:
    try:
      self.call("Browser.close")
    except (RuntimeError, OSError):
      pass
    try:
      self._process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self._process.kill()
    shutil.rmtree(self._profile, ignore_errors=True)


def network_problems(events: list[dict]) -> list[str]:
  problems = []
  requests = {}
  for event in events:
    method, params = event.get("method"), event.get("params", {})
    if method == "Network.requestWillBeSent":
      url = params["request"]["url"]
      requests[params["requestId"]] = url
      if not url.startswith(("file:", "data:", "about:", "blob:")):
        problems.append(f"a request off the machine: {url[:100]}")
    elif method == "Network.loadingFailed" and not params.get("canceled"):
      url = requests.get(params["requestId"], "?")
      problems.append(f"failed to load {url[:100]}: {params.get('errorText')}")
  return problems


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--site", default=str(ROOT / "docs/_build/html"))
  parser.add_argument("--width", type=int, default=1400)
  parser.add_argument("--height", type=int, default=1000)
  parser.add_argument(
    "--screenshots",
    metavar="DIR",
    help="save the landing page, the API page and the migration guide there",
  )
  parser.add_argument(
    "pages", nargs="*", help="pages to check, relative to --site (default: all)"
  )
  args = parser.parse_args()
  site = pathlib.Path(args.site).resolve()
  if not (site / "docs/index.html").exists():
    print(f"docs_check: no site at {site}; run `make docs` first.")
    return 2
  pages = args.pages or sorted(
    str(p.relative_to(site))
    for p in site.rglob("*.html")
    if not any(part in str(p.relative_to(site)) for part in SKIP)
    # The site root's index.html only redirects to docs/index.html.
    and 'http-equiv="refresh"' not in p.read_text()
  )
  started = time.monotonic()
  browser = Browser(args.width, args.height)
  failed = 0
  try:
    if not browser.offline:
      print(
        "docs_check: no network namespace (unshare --net); names resolve"
        " to nothing, and a request off the machine fails the check."
      )
    for page in pages:
      events = browser.open((site / page).as_uri())
      problems = browser.evaluate(PAGE_PROBLEMS) + network_problems(events)
      for problem in problems:
        print(f"{page}: {problem}")
      failed += bool(problems)
    if args.screenshots:
      out = pathlib.Path(args.screenshots)
      out.mkdir(parents=True, exist_ok=True)
      for name, (page, selector) in SCREENSHOTS.items():
        browser.open((site / page).as_uri())
        browser.evaluate(PAGE_PROBLEMS)  # waits for MathJax and the fonts
        browser.screenshot(out / f"{name}.png", selector)
        print(f"screenshot: {out / f'{name}.png'}")
  finally:
    browser.close()
  seconds = time.monotonic() - started
  print(
    f"docs_check: {len(pages)} pages at {args.width}px, {failed} with"
    f" problems ({seconds:.0f} s)"
  )
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
