// kernelcrew UI: live updates over Server-Sent Events and the chat form, without a framework.
// The server renders every page; on an event this script fetches the page again and swaps in the
// regions marked data-refresh, so there is one renderer and the keyboard focus is never lost.
"use strict";

const REFRESH_DELAY_MS = 250;

async function refreshRegions() {
  const response = await fetch(location.pathname + location.search, { headers: { accept: "text/html" } });
  if (!response.ok) return;
  const fresh = new DOMParser().parseFromString(await response.text(), "text/html");
  for (const region of document.querySelectorAll("[data-refresh]")) {
    const replacement = fresh.getElementById(region.id);
    if (!replacement) continue;
    const openDetails = new Set([...region.querySelectorAll("details[open]")].map((d) => d.id));
    region.innerHTML = replacement.innerHTML;
    for (const d of region.querySelectorAll("details[id]")) {
      if (openDetails.has(d.id)) d.open = true;
    }
  }
  const page = fresh.querySelector("[data-job]");
  const current = document.querySelector("[data-job]");
  if (page && current) current.dataset.ended = page.dataset.ended;
}

function debounced(fn) {
  let timer = null;
  return () => {
    clearTimeout(timer);
    timer = setTimeout(fn, REFRESH_DELAY_MS);
  };
}

function watchJobList(region) {
  const refresh = debounced(refreshRegions);
  new EventSource(region.dataset.liveList).addEventListener("changed", refresh);
}

const ENDED = new Set(["succeeded", "failed", "cancelled"]);

function watchJob(page) {
  let source = null;
  const refresh = debounced(refreshRegions);
  const open = () => {
    if (source) source.close();
    source = new EventSource(`/jobs/${page.dataset.job}/events?after=${page.dataset.after}`);
    source.onmessage = refresh;
    for (const kind of ["status", "baseline", "plan", "code", "verify", "timing", "ncu", "decide", "reply",
      "message", "message_taken", "done", "error", "kb", "kb_record", "verify_started", "benchmark"]) {
      source.addEventListener(kind, (event) => {
        page.dataset.after = event.lastEventId || page.dataset.after;
        refresh();
        if (kind === "status" && ENDED.has(JSON.parse(event.data).status)) {
          source.close(); // the stream ends with the job; a chat message opens it again
        }
      });
    }
  };
  if (page.dataset.ended !== "true") open();
  const form = document.getElementById("chat-form");
  if (form) {
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const button = form.querySelector("button");
      button.disabled = true;
      try {
        const response = await fetch(form.action, { method: "POST", body: new FormData(form) });
        if (response.ok) {
          form.querySelector("textarea").value = "";
          await refreshRegions();
          open(); // the job may have been queued again by the message: follow it
        }
      } finally {
        button.disabled = false;
      }
    });
  }
}

document.addEventListener("DOMContentLoaded", () => {
  const list = document.querySelector("[data-live-list]");
  if (list) watchJobList(list);
  const page = document.querySelector("[data-job]");
  if (page) watchJob(page);
});
