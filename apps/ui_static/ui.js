// Follows the log: asks /api/head every second and, when the log moved, fetches this page's live
// part again (its data-fragment URL) and swaps it in, so new events appear without a reload.
"use strict";
(function () {
  const live = document.getElementById("live");
  const follow = document.getElementById("follow");
  if (!live || !follow) {
    return;
  }
  let last = null;
  async function tick() {
    try {
      const r = await fetch("/api/head", { headers: { Accept: "application/json" }, credentials: "same-origin" });
      if (r.status === 401) {
        follow.textContent = "signed out: reload to sign in";
        follow.className = "follow lost";
        return;
      }
      const head = await r.json();
      const key = JSON.stringify(head);
      if (last !== null && key !== last) {
        const f = await fetch(live.dataset.fragment, { credentials: "same-origin" });
        if (f.ok) {
          live.innerHTML = await f.text();
          live.dataset.refreshed = String(Number(live.dataset.refreshed || "0") + 1);
        }
      }
      last = key;
      follow.textContent = "following the log · position " + head.position;
      follow.dataset.position = String(head.position);
      follow.className = "follow";
    } catch (err) {
      follow.textContent = "lost the server; retrying";
      follow.className = "follow lost";
    }
    setTimeout(tick, 1000);
  }
  tick();
})();
