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
