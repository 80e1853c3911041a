// Break opportunities (<wbr>) in table headers and inline code after the
// . _ ( = , / of a name, so that `should_skip_update_fn=optax.skip_not_finite` or a header
// `optax_accum.apply_updates` wraps between its parts instead of pushing
// the table wider than the page (custom.css; tools/docs_check.py holds it).
// Only before a letter: 1.00 and 0/4 stay whole. A <wbr> is not copied.
document.addEventListener("DOMContentLoaded", () => {
  const cells = document.querySelectorAll("article table :is(th, td code)");
  for (const cell of cells) {
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    const texts = [];
    while (walker.nextNode()) texts.push(walker.currentNode);
    for (const text of texts) {
      const parts = text.data.split(/(?<=[._(=,/])(?=[A-Za-z_*])/);
      if (parts.length < 2) continue;
      const pieces = document.createDocumentFragment();
      parts.forEach((part, i) => {
        if (i > 0) pieces.append(document.createElement("wbr"));
        pieces.append(part);
      });
      text.replaceWith(pieces);
    }
  }
});
