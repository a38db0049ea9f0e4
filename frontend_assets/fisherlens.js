// fisherlens: keep the address bar in step with the tab shown, so it can always be copied.
// Tab clicks are real user events (programmatic tab changes from the server set the URL
// through the hidden #fl-url textbox instead, see app/ui.py URL_JS).
(function () {
  const TABS = { "New job": "new", "Jobs": "jobs", "Result": "result", "Token explorer": "tokens",
                 "Compare": "compare", "Models": "models" };
  document.addEventListener("click", function (e) {
    const b = e.target.closest && e.target.closest('button[role="tab"]');
    if (!b || !b.id || !b.id.startsWith("tab-")) return;  // sub-tabs of the forms keep the URL
    const name = TABS[b.innerText.trim()];
    if (!name) return;
    let u = "/?tab=" + name;
    if (name === "result" && window.__flResultUrl) u = window.__flResultUrl;
    if (name === "compare" && window.__flCompareUrl) u = window.__flCompareUrl;
    window.history.replaceState(null, "", u);
  }, true);
})();

// Elapsed time of a queued or running job (app/render.py progress_html: data-since, UTC ISO),
// ticked every second between the server's progress updates.
(function () {
  function tick() {
    document.querySelectorAll(".fl-elapsed[data-since]").forEach(function (el) {
      let since = el.getAttribute("data-since");
      if (!/[zZ]|[+-]\d\d:?\d\d$/.test(since)) since += "Z";
      const s = Math.max(0, Math.round((Date.now() - Date.parse(since)) / 1000));
      if (!isFinite(s)) return;
      const text = s < 120 ? s + " s" : Math.floor(s / 60) + " min " + (s % 60) + " s";
      el.textContent = "\u00b7 " + (el.getAttribute("data-what") || "running") + " for " + text;
    });
  }
  setInterval(tick, 1000);
  document.addEventListener("DOMContentLoaded", tick);
})();
